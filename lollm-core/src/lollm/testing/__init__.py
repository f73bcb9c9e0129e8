"""Test tooling shipped with lollm-core: real checkpoints, tiny random checkpoints, and the conformance kit for plugin authors."""
