"""``lollm trace``, the command: run a prompt with the recorder on (:mod:`lollm.trace`), compare
with transformers, write the page.
"""
