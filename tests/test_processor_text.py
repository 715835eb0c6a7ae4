"""Issue 65, defect 1: unsloth loads Qwen3.5 (a vision-language checkpoint) with its vision loader and returns a
processor (transformers maps qwen3_5 to Qwen3VLProcessor), not a tokenizer. A processor's first positional argument is
`images`, so `processor(text)` reads the text as an image path, and its chat template tokenizes to a [1, n] batch, so a
prompt counted through it is 1 token long. Every place that turns text into ids goes through its tokenizer
(data.text_tokenizer): the vLLM prompts, prompt lengths (over-long prompts dropped), our generation, the evaluation's
completion ids, the pad token.

The processor here is the real Qwen3VLProcessor with the real (PIL) Qwen2-VL image processor built from
Qwen3.5-0.8B's committed preprocessor_config.json, around the tiny model's tokenizer; its video processor needs
torchvision, which neither install set has, so transformers' BaseVideoProcessor stands in for it (text never reaches
it), accepted past ProcessorMixin's class check for that one argument."""
import json

import pytest

from conftest import REPO, load_handle

FIXTURE = REPO / "tests" / "fixtures" / "checkpoints" / "Qwen3.5-0.8B" / "preprocessor_config.json"
PROMPT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 17 + 25?"}]


def qwen3vl_processor(tokenizer, monkeypatch):
    """Qwen3VLProcessor around `tokenizer`, as unsloth's vision loader returns it for Qwen3.5."""
    from transformers import processing_utils
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    config = json.loads(FIXTURE.read_text())
    assert config["processor_class"] == "Qwen3VLProcessor"
    images = Qwen2VLImageProcessorPil(**{k: v for k, v in config.items()
                                         if k not in ("image_processor_type", "processor_class")})
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class
    with monkeypatch.context() as patch:
        patch.setattr(processing_utils.ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: type(arg) if name == "video_processor" else check(self, name, arg))
        processor = Qwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=BaseVideoProcessor(),
                                     chat_template=tokenizer.chat_template)
    return processor


@pytest.fixture()
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_processor_reads_text_as_an_image_and_counts_a_chat_prompt_as_one_token(tokenizer, monkeypatch):
    """What the code met before the fix (the reading of issue 65, executed)."""
    processor = qwen3vl_processor(tokenizer, monkeypatch)
    with pytest.raises(ValueError, match="image"):
        processor("What is 17 + 25?", add_special_tokens=False)
    assert len(processor.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)) == 1
    assert not hasattr(processor, "pad_token")


def test_text_tokenizer_unwraps_a_processor_and_leaves_a_tokenizer(tokenizer, monkeypatch):
    from lowvram_grpo.task.data import text_tokenizer

    processor = qwen3vl_processor(tokenizer, monkeypatch)
    assert text_tokenizer(processor) is tokenizer and text_tokenizer(tokenizer) is tokenizer
    assert text_tokenizer(None) is None
    template = tokenizer.chat_template
    tokenizer.chat_template = None  # a tokenizer without the template its processor has: it gets the processor's
    processor.chat_template = template
    assert text_tokenizer(processor).chat_template == template


def test_prompt_lengths_through_a_processor_are_the_tokenizers_and_long_prompts_are_dropped(tokenizer, monkeypatch):
    from lowvram_grpo.task.data import drop_long_prompts, prompt_tokens

    processor = qwen3vl_processor(tokenizer, monkeypatch)
    length = prompt_tokens(tokenizer, PROMPT)
    assert length > 10 and prompt_tokens(processor, PROMPT) == length
    assert prompt_tokens(processor, "What is 17 + 25?") == prompt_tokens(tokenizer, "What is 17 + 25?")
    long_prompt = [PROMPT[0], {"role": "user", "content": "What is 17 + 25? " * 40}]
    kept, dropped = drop_long_prompts([{"prompt": PROMPT}, {"prompt": long_prompt}], processor, length + 5)
    assert dropped == 1 and kept == [{"prompt": PROMPT}]


def test_vllm_prompts_and_the_pad_token_go_through_the_processors_tokenizer(tokenizer, monkeypatch):
    """unsloth's engine is handed token ids (unsloth_backend.token_prompts) and the loader gives the tokenizer a pad
    token (pad_with_eos): both through the tokenizer inside the processor. Before: ValueError (text read as an
    image) and AttributeError (a processor has no pad_token)."""
    from lowvram_grpo.model.unsloth_backend import pad_with_eos, token_prompts

    processor = qwen3vl_processor(tokenizer, monkeypatch)
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert token_prompts(processor, [text]) == [{"prompt_token_ids": ids}]
    tokenizer.pad_token = None
    pad_with_eos(processor)
    assert tokenizer.pad_token == tokenizer.eos_token


@pytest.mark.slow  # loads the tiny model
def test_a_handle_holding_a_processor_generates_and_scores_through_its_tokenizer(tiny_model_dir, monkeypatch):
    """The tiny model's handle with the processor as its tokenizer, as unsloth's vision loader gives it: the chat
    template, our generation (TransformersEngine) and the evaluation's completion ids all run, and give what the
    tokenizer alone gives; TRL's processing_class stays the processor."""
    from lowvram_grpo.evaluate.evaluation import _reward_keywords
    from lowvram_grpo.model.handle import SamplingParams

    handle = load_handle("tiny", ["decode.loop=transformers"])
    tokenizer = handle.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=8, seed=0)
    expected = handle.generate([PROMPT], params)
    handle.tokenizer = qwen3vl_processor(tokenizer, monkeypatch)
    assert handle.text_tokenizer is tokenizer
    assert handle.apply_chat_template(PROMPT) == tokenizer.apply_chat_template(PROMPT, tokenize=False,
                                                                                add_generation_prompt=True)
    got = handle.generate([PROMPT], params)
    assert got == expected and got[0].num_tokens > 0
    ids = _reward_keywords([{"prompt": PROMPT}], [got[0].text], 1, handle.tokenizer)["completion_ids"]
    assert ids == [tokenizer(got[0].text, add_special_tokens=False)["input_ids"]]
