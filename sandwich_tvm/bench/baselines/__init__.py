"""Other engines run on the same weights for the end-to-end benchmark (optional extras)."""
