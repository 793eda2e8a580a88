"""Reference targets with known behaviour, for self-tests and the demo."""
