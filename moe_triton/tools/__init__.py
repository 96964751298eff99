"""The tools room: the command line, the demo, the probe and the bench helpers. They may import
any of the library; nothing in the library imports them (tests/test_layout.py checks)."""
