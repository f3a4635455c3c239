"""The batch runners of the background processes: no SQL, no HTTP."""
