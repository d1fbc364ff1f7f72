"""What the tests share, by topic (the fixtures among them are registered by conftest.py)."""
