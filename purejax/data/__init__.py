"""Data, from files to batches: tokenizers, corpora, batches, MNIST and TFDS.

`tokenizers` (characters, GPT-2 BPE; `bpe_files` finds BPE files offline,
`tokenize_files` tokenizes large files in parallel, `tokenizer_json` reads
Hugging Face `tokenizer.json` files), `corpus` (`load_corpus`
for TFDS text, `.txt` files and nanoGPT folders, and the token cache),
`batches` (batches drawn on the device or read by the host), `datasets`
(MNIST and Tiny Shakespeare through TFDS, an IDX reader), `chat` (an instruct
model's chat template, rendered and encoded as transformers does).
"""
