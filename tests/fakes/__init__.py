"""Test doubles that stand in for real parts where a test is not about containment."""
