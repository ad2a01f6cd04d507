HEAD = "0038"  # the newest revision; tests/test_migrations.py checks it against Alembic
