"""Planning from observations: corpora, observation files, the planner, and held-out evaluation."""
