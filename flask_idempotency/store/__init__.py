"""The store: the only code that speaks SQL or holds a database connection."""
