"""The receiver stage: reads a principal's reply stream, checks each reply and applies it
once, with its receipt, in one commit (``receiver``)."""
