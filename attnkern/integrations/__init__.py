"""Integrations of attnkern with other libraries (each imports its library lazily)."""
