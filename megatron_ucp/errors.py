"""One exception type for every user-facing failure: the message names the culprit and the fix."""


class UCPError(RuntimeError):
    """Bad checkpoint, bad target layout or bad arguments. The message says what to do."""
