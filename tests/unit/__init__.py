"""Tests in one process: Flask's test client against a real PostgreSQL."""
