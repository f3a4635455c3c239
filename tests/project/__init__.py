"""Tests of what ships beside the code: docs, README, package, rules, layout, plugin."""
