"""The application layer: run directories, checkpoints, metrics records and their validation, summaries, exports,
trackers, signals and progress."""
