HEAD = "0037"  # the newest revision; tests/test_migrations.py checks it against Alembic
