"""The parts of bench/sync.py: a real serve (served), passes over N functions in this
process (scale), timers around public calls (timers), and what both share (common)."""
