"""Selectors: pure tensor functions that decide which visual tokens survive a pruning stage."""
