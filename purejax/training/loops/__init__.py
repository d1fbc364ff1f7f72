"""The training loop, written once (`skeleton`), and what it drives: a GPT run alone, a
sweep's runs, the MLP; how a GPT run starts, what its evaluations measure, named recipes."""
