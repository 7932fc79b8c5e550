"""What an epoch is: its plan, order and shuffle, state and resume, the early start of the next one, direct execution."""
