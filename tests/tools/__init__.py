"""Checks run by ``make test`` beside the tests (``check_cycles``)."""
