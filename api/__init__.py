"""The HTTP edge: accepts jobs, answers at once, serves their state."""
