HEAD = "0040"  # the newest revision; tests/test_migrations.py checks it against Alembic
