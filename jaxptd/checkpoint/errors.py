"""The checkpoint package's errors: `CheckpointError`, a user-caused checkpoint problem in
one line, and `ModelMismatch`, a checkpoint of another model's leaves or shapes."""


class CheckpointError(ValueError):
    """A user-caused checkpoint problem (unwritable directory, unreadable step); one line."""


class ModelMismatch(CheckpointError):
    """A checkpoint whose leaves or shapes are another model's than the run's."""
