"""The toolkit: one recipe per model family on Hugging Face Accelerate (README.md).

Importing it, or any of its modules, changes nothing in the process: no signal handler, no environment variable, no
thread, no exit hook. A recipe's entry point calls toolkit.process.begin_process() first, before torch, and
toolkit.run.start_run() installs the rest (toolkit.process says which does what)."""
