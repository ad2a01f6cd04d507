HEAD = "0031"  # the newest revision; tests/test_migrations.py checks it against Alembic
