"""Checks that say what went wrong in words (the workshop grades attendees with the stage tests: a failure must read
as a sentence, not `assert 0 > 0`)."""


def refuses(exc, fn, *args, what: str):
    """fn(*args) must raise exc; returns the exception. what: the call in words, for the message."""
    try:
        fn(*args)
    except exc as e:
        return e
    raise AssertionError(f"{what} did not raise {exc.__name__}")
