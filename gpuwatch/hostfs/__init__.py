"""The I/O edge: everything that reads the host's /sys, /proc and /dev under a root.

Readers never raise for what a host mid-hotplug does (vanished files, dangling links,
garbage): they return the documented empty value and let the model carry on.
"""
