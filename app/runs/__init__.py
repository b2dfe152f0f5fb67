"""The Runs tab: the user's run folders, the comparison of several, one run's log, resume and delete."""
