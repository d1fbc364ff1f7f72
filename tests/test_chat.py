"""data.chat: chat templates rendered and encoded as transformers' `apply_chat_template` does.

The fast tests use a small ChatML-style template over a tokenizer trained
here; the slow one compares the ids with transformers' on a real instruct
model's folder, for several conversations.
"""

import json
import pathlib

import pytest

from helpers.data import SHAKESPEARE, need, train_tokenizer_json
from purejax.data import chat
from purejax.data import tokenizer_json
from real_model import smollm2_folder  # noqa: F401  (the fixture)

CHATML = ("{% for message in messages %}"
          "{% if loop.first and message['role'] != 'system' %}<s>system\nBe kind.</s>\n{% endif %}"
          "{{ '<s>' + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."},
     {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Arr, ahoy there."},
     {"role": "user", "content": "Where is the treasure?\nTell me  now."}],
    [{"role": "user", "content": "Say <|im_end|> twice: <|im_end|>"},
     {"role": "assistant", "content": "  spaces and\ttabs  "}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
  root = tmp_path_factory.mktemp("chat-model")
  train_tokenizer_json(root, SHAKESPEARE[:20000])  # special tokens <s> (0) and </s> (1)
  (root / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
       "pad_token": "</s>", "chat_template": CHATML}))
  return root


def test_renders_a_conversation_with_and_without_the_generation_prompt(folder):
  fmt = chat.load_chat_format(str(folder))
  assert (fmt.bos_token, fmt.eos_token, fmt.add_bos) == ("<s>", "</s>", False)
  messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
  finished = "<s>system\nBe kind.</s>\n<s>user\nHi</s>\n<s>assistant\nHello.</s>\n"
  assert chat.render(fmt, messages) == finished
  assert chat.render(fmt, messages, add_generation_prompt=True) == finished + "<s>assistant\n"
  system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi",
                                                         "name": None}]
  assert chat.render(fmt, system) == "<s>system\nBe terse.</s>\n<s>user\nHi</s>\n"


def test_special_tokens_in_the_rendered_text_are_one_id_each(folder):
  fmt = chat.load_chat_format(str(folder))
  tok = tokenizer_json.load(str(folder))
  messages = [{"role": "user", "content": "Hi"}]
  ids = chat.encode(tok, fmt, messages, add_generation_prompt=True)
  text = chat.render(fmt, messages, add_generation_prompt=True)
  assert ids == list(tok.encode(text))
  assert ids[0] == 0 and ids.count(0) == 3 and ids.count(1) == 2  # <s> x3, </s> x2
  assert tok.decode(ids) == text


def test_bos_is_added_once_when_the_format_says_so(folder):
  tok = tokenizer_json.load(str(folder))
  fmt = chat.ChatFormat(template="{{ messages[0]['content'] }}", bos_token="<s>",
                        eos_token="</s>", add_bos=True)
  assert chat.encode(tok, fmt, [{"role": "user", "content": "Hi"}])[0] == 0
  once = chat.encode(tok, fmt, [{"role": "user", "content": "<s>Hi"}])
  assert once[0] == 0 and once.count(0) == 1
  assert chat.encode(tok, chat.ChatFormat("{{ messages[0]['content'] }}", "<s>", "</s>"),
                     [{"role": "user", "content": "Hi"}]) == list(tok.encode("Hi"))


def test_template_file_and_generation_config_are_read(folder, tmp_path):
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes((folder / name).read_bytes())
  (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[-1]['content'] }}")
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
  fmt = chat.load_chat_format(str(tmp_path))
  assert fmt.source.endswith("chat_template.jinja")  # the file wins, as in transformers
  assert chat.render(fmt, [{"role": "user", "content": "x"}]) == "<s>x"
  assert fmt.stop_ids == (1, 0)
  (tmp_path / "generation_config.json").unlink()
  assert chat.load_chat_format(str(tmp_path)).stop_ids == ()
  tok = tokenizer_json.load(str(tmp_path))
  assert chat.load_chat_format(str(tmp_path), tok).stop_ids == (1,)  # the tokenizer's EOS


def test_several_named_templates_use_the_default(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
      {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}))
  assert chat.render(chat.load_chat_format(str(tmp_path)), [{"role": "user"}]) == "plain"


def test_templates_see_transformers_globals():
  fmt = chat.ChatFormat(
      template="{{ messages | tojson }}|{{ tools is none }}|{{ strftime_now('%Y') | length }}"
               "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
               "|{{ m.role }}{% endfor %}", bos_token="<s>")
  assert chat.render(fmt, [{"role": "user", "content": "<&>"}, {"role": "bot"}]) == (
      '[{"role": "user", "content": "<&>"}, {"role": "bot"}]|True|4|user')


def test_bad_templates_and_conversations_are_one_line_errors(folder, tmp_path):
  with pytest.raises(chat.ChatTemplateError, match=r"has no chat template .* a base model"):
    chat.load_chat_format(str(tmp_path))
  refusing = chat.ChatFormat(
      template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations "
               "must start with a user message') }}{% endif %}ok")
  with pytest.raises(chat.ChatTemplateError, match="refused this conversation: "
                     "Conversations must start with a user message"):
    chat.render(refusing, [{"role": "assistant", "content": "Hi"}])
  with pytest.raises(chat.ChatTemplateError, match="does not parse"):
    chat.render(chat.ChatFormat("{% for %}"), [{"role": "user", "content": "x"}])
  fmt = chat.load_chat_format(str(folder))
  with pytest.raises(chat.ChatTemplateError, match="conversation is empty"):
    chat.render(fmt, [])
  with pytest.raises(chat.ChatTemplateError, match="a message is a dict with a 'role'"):
    chat.render(fmt, ["Hi"])
  with pytest.raises(chat.ChatTemplateError, match="a list of messages"):
    chat.render(fmt, "Hi")
  with pytest.raises(chat.ChatTemplateError, match="sandbox|unsafe|refused"):
    chat.render(chat.ChatFormat("{{ ''.__class__.__mro__ }}"), [{"role": "user"}])


@pytest.mark.slow
def test_ids_equal_transformers_apply_chat_template(smollm2_folder):
  transformers = need("transformers")
  reference = transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))
  tok = tokenizer_json.load(str(smollm2_folder))
  fmt = chat.load_chat_format(str(smollm2_folder), tok)
  assert fmt.stop_ids == (2,) and fmt.eos_token == "<|im_end|>"
  for messages in CONVERSATIONS:
    for prompt in (False, True):
      expected = reference.apply_chat_template(messages, tokenize=True,
                                               add_generation_prompt=prompt)
      expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
      assert chat.encode(tok, fmt, messages, add_generation_prompt=prompt) == expected
      assert chat.render(fmt, messages, add_generation_prompt=prompt) == (
          reference.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=prompt))


@pytest.mark.slow
def test_a_character_the_vocabulary_lacks_is_an_error_not_dropped(smollm2_folder):
  # SmolLM2's byte-level vocabulary has no token for a few control bytes; the
  # tokenizers library alone would encode "a\x04b" as "ab".
  tok = tokenizer_json.load(str(smollm2_folder))
  assert tok.tokenizer.decode(tok.tokenizer.encode("a\x04b").ids) == "ab"
  with pytest.raises(tokenizer_json.TokenizerError, match=r"e.g. '\\x04' .* dropped"):
    tok.encode("a\x04b")
  assert tok.decode(tok.encode("a\x05b\n\t")) == "a\x05b\n\t"


def test_a_template_recorded_in_a_tokenizer_spec_makes_a_format(folder):
  # A GGUF file's tokenizer records its template, BOS/EOS and whether BOS is added.
  import types
  tok = tokenizer_json.load(str(folder))
  spec = types.SimpleNamespace(chat_template=CHATML, bos_token="<s>", eos_token="</s>",
                               add_bos=True, encoding_file="model.gguf", name="gguf")
  fmt = chat.format_of_spec(spec, tok)
  assert (fmt.add_bos, fmt.stop_ids, fmt.source) == (True, (1,), "model.gguf")
  ids = chat.encode(tok, fmt, [{"role": "user", "content": "Hi"}])
  assert ids[0] == 0 and ids.count(0) == 2  # the template's <s> first: BOS is not doubled
  assert chat.format_of_spec(tok.spec()) is None  # a tokenizer.json spec records none


def test_a_gguf_chat_stops_at_the_end_of_turn_its_template_writes():
  """A GGUF names one EOS (Gemma's `<eos>`); the turn ends at `<end_of_turn>`, which
  llama.cpp knows by its text: the stop ids hold both, as the template writes it."""
  import types  # pylint: disable=g-import-not-at-top
  ids = {"<eos>": 1, "<end_of_turn>": 106, "<|im_end|>": 7}
  tokenizer = types.SimpleNamespace(encode=lambda text: [ids[text]] if text in ids else [0, 0])
  gemma = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>\n{% endfor %}"
  spec = types.SimpleNamespace(chat_template=gemma, bos_token="<bos>", eos_token="<eos>",
                               add_bos=True, encoding_file="gemma.gguf", name="gguf")
  assert chat.format_of_spec(spec, tokenizer).stop_ids == (1, 106)
  spec.chat_template = gemma.replace("<end_of_turn>", "|")  # not written: not a stop
  assert chat.format_of_spec(spec, tokenizer).stop_ids == (1,)
