"""The plan document: its schema, data model, semantic checks, and the active sets it allows."""
