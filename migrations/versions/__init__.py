HEAD = "0002"  # the newest revision; tests/test_migrations.py checks it against Alembic
