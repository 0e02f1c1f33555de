"""Hostile inputs, one module per class of attack: each test generates the attack and asserts the refusal."""
