"""Typed fakes of stoker's own seams, shared by every test that needs one."""
