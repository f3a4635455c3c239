"""The apps the tests serve, in process or as ``tests.apps.<name>`` in gunicorn."""
