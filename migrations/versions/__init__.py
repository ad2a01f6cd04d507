HEAD = "0039"  # the newest revision; tests/test_migrations.py checks it against Alembic
