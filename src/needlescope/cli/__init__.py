"""Command-line entry points. Only this package reads argv and prints."""
