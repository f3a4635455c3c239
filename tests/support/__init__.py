"""The harness the tests share."""
