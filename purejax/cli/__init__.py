"""The command lines: the only layer that speaks of --flags.

    python -m purejax.train      # purejax.cli.train (its flags: train_flags)
    python -m purejax.sample     # purejax.cli.sample
    python -m purejax.convert    # purejax.cli.convert
    python -m purejax.replay     # purejax.cli.replay
    python -m purejax.plot       # purejax.cli.plot

`python -m purejax.cli.train` runs the same program. Each command's
`run(argv) -> exit code` parses `argv` into fresh flags (`command.run`), so
it runs in-process as often as a test likes; its errors are one line,
`error: ...`, with exit code 1 (`errors`). `forms_flags` holds the execution
flags that train and sample share.
"""
