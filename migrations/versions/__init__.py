HEAD = "0020"  # the newest revision; tests/test_migrations.py checks it against Alembic
