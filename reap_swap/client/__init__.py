"""The active-set client: per-prompt selection of slices, and the HTTP flows that pin them."""
