"""Rows as the task kinds read them, on the floor below the kinds: Arrow columns as numpy (`arrow`), conversations
through a chat template (`chat`), documents split into segments (`segments`). The data package above loads and
encodes a data set by calling the kinds, which read their rows with these."""
