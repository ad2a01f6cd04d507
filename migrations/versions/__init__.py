HEAD = "0036"  # the newest revision; tests/test_migrations.py checks it against Alembic
