"""Tiny diffusers pipelines built offline: seeded random weights from configs.

No hub is reachable, so every component is made here: each transformer, VAE and text
encoder from its config class with a fixed seed (hidden size 16, one layer), and every
tokenizer as a word-level ``tokenizers`` model over the words of the prompts and
templates the pipelines use (others map to the unknown token). Sizes are the smallest each
pipeline accepts: what a tpu run costs is compiling its distinct ops (100-300 small
programs eagerly, one or two graphs compiled), not computing.

``PIPELINES`` names each pipeline's case: ``build()`` returns it on CPU, float32, and
``call(pipe, generator)`` runs two inference steps and returns its outputs as numpy
arrays: {"images"}, {"frames"}, or LTX-2's video and audio latents {"frames", "audio"}.
The initial noise is drawn from the CPU ``generator`` the caller passes (Note [CPU
generators on tpu])."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import diffusers as df  # noqa: E402
import numpy as np  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers as tf  # noqa: E402

STEPS = 2
PROMPT = "a cat on a mat"
NEGATIVE = "blurry"
_WORDS = (
    "a cat dog on the mat rug blurry describe image by detailing color shape size texture quantity "
    "text spatial relationships of objects and background system user assistant"
).split()


def tiny_tokenizer(specials: dict, max_length: int, extra: tuple = ()):
    """A word-level fast tokenizer: ``specials`` maps roles (``eos_token``, ``pad_token``,
    ``unk_token``, ``bos_token``) to their strings; these and the ``extra`` special tokens
    come first in the vocabulary, then the words of ``_WORDS``, then the punctuation the
    pre-tokenizer splits off."""
    names = list(dict.fromkeys([*specials.values(), *extra]))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(names + _WORDS + list(",.:<>|_\n")))}
    model = tokenizers.models.WordLevel(vocab, unk_token=specials["unk_token"])
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(names)
    if "bos_token" in specials:  # Gemma-style: <bos> first
        bos = specials["bos_token"]
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
        )
    elif "eos_token" in specials:  # T5 / CLIP-style: </s> last
        eos = specials["eos_token"]
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"$A {eos}", special_tokens=[(eos, vocab[eos])]
        )
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **specials)


_CLIP_SPECIALS = dict(bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                      unk_token="<|endoftext|>", pad_token="<|endoftext|>")  # fmt: skip
_T5_SPECIALS = dict(pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _clip_tokenizer():
    specials = dict(_CLIP_SPECIALS)
    specials.pop("bos_token")  # keep the post-processor's eos at the end
    return tiny_tokenizer(specials, max_length=8)


def _clip(projection: bool):
    cls = tf.CLIPTextModelWithProjection if projection else tf.CLIPTextModel
    config = tf.CLIPTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_hidden_layers=1, max_position_embeddings=8, projection_dim=16,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return cls(config).eval()


def _t5(cls=tf.T5EncoderModel, d_model: int = 16):
    config = tf.T5Config(
        vocab_size=64, d_model=d_model, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return cls(config).eval()


def _flow_vae(latent_channels: int):
    # One block: no downsampling, so latents have the image's height and width.
    return df.AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip


def build_sd3():
    torch.manual_seed(0)
    transformer = df.SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=32, out_channels=4, pos_embed_max_size=8,
    )  # fmt: skip
    return df.StableDiffusion3Pipeline(
        transformer=transformer, vae=_flow_vae(4), scheduler=df.FlowMatchEulerDiscreteScheduler(),
        text_encoder=_clip(True), tokenizer=_clip_tokenizer(),
        text_encoder_2=_clip(True), tokenizer_2=_clip_tokenizer(),
        text_encoder_3=_t5(), tokenizer_3=tiny_tokenizer(_T5_SPECIALS, max_length=8),
    )  # fmt: skip


def build_flux():
    torch.manual_seed(0)
    transformer = df.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    return df.FluxPipeline(
        transformer=transformer, vae=_flow_vae(1), scheduler=df.FlowMatchEulerDiscreteScheduler(),
        text_encoder=_clip(False), tokenizer=_clip_tokenizer(),
        text_encoder_2=_t5(), tokenizer_2=tiny_tokenizer(_T5_SPECIALS, max_length=8),
    )  # fmt: skip


def build_qwenimage():
    torch.manual_seed(0)
    transformer = df.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4),
    )  # fmt: skip
    vae = df.AutoencoderKLQwenImage(
        base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
    )  # fmt: skip
    config = tf.Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, vocab_size=64, rope_theta=1e6, bos_token_id=0,
            eos_token_id=0,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=16),
        vocab_size=64, image_token_id=60, video_token_id=61, vision_start_token_id=62,
        vision_end_token_id=63, vision_token_id=63,
    )  # fmt: skip
    tokenizer = tiny_tokenizer(
        dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>"),
        max_length=64, extra=("<|im_start|>", "<|im_end|>"),
    )  # fmt: skip
    pipe = df.QwenImagePipeline(
        transformer=transformer, vae=vae, scheduler=df.FlowMatchEulerDiscreteScheduler(),
        text_encoder=tf.Qwen2_5_VLForConditionalGeneration(config).eval(), tokenizer=tokenizer,
    )  # fmt: skip
    return pipe


def build_wan():
    torch.manual_seed(0)
    transformer = df.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=16, num_layers=1,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )  # fmt: skip
    vae = df.AutoencoderKLWan(
        base_dim=4, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4, scale_factor_temporal=2,
        scale_factor_spatial=2,
    )  # fmt: skip
    return df.WanPipeline(
        transformer=transformer, vae=vae, scheduler=df.FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=_t5(tf.UMT5EncoderModel), tokenizer=tiny_tokenizer(_T5_SPECIALS, 8),
    )  # fmt: skip


def build_ltx2():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    config = tf.Gemma3Config(
        text_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, vocab_size=64, sliding_window=8,
            pad_token_id=0, bos_token_id=2, eos_token_id=1,
        ),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, image_size=8, patch_size=4),
        mm_tokens_per_image=4, image_token_id=63, boi_token_index=62, eoi_token_index=61,
    )  # fmt: skip
    text_encoder = tf.Gemma3ForConditionalGeneration(config).eval()
    tokenizer = tiny_tokenizer(
        dict(pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"), 8
    )
    transformer = df.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
        num_layers=1, caption_channels=16, rope_double_precision=False, rope_type="split",
    )  # fmt: skip
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=2, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32,
        rope_double_precision=False, rope_type="split",
    )  # fmt: skip
    vae = df.AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
        downsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
        patch_size=1, patch_size_t=1, decoder_causal=False,
    )  # fmt: skip
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    audio_vae = df.AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, in_channels=2,
        resolution=32, latent_channels=2, mel_bins=8,
    )  # fmt: skip
    vocoder = LTX2Vocoder(
        in_channels=16, hidden_channels=8, out_channels=2, upsample_kernel_sizes=[4],
        upsample_factors=[2], resnet_kernel_sizes=[3], resnet_dilations=[[1]],
        output_sampling_rate=16000,
    )  # fmt: skip
    return df.LTX2Pipeline(
        scheduler=df.FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
        transformer=transformer, vocoder=vocoder,
    )  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One pipeline: its builder, its call's arguments besides the prompt, generator,
    steps and ``output_type="np"``, and what its compiled transformer does per call."""

    build: Callable[[], object]
    kwargs: dict
    calls: int  # transformer calls per pipeline call (steps x guidance passes)
    graphs: int = 1  # graphs the first compiled call captures

    def call(self, pipe, generator: torch.Generator) -> dict:
        """One pipeline call's outputs as numpy arrays: ``images``, or ``frames`` (and
        ``audio`` for LTX-2)."""
        kwargs = {"output_type": "np", **self.kwargs}
        with torch.no_grad():
            out = pipe(PROMPT, generator=generator, num_inference_steps=STEPS, **kwargs)
        return {
            k: np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v)
            for k in ("images", "frames", "audio")
            if (v := getattr(out, k, None)) is not None
        }


PIPELINES = {
    # Classifier-free guidance on: one transformer call on a batch of 2 per step.
    "sd3": Case(
        build_sd3,
        calls=STEPS,
        kwargs=dict(
            negative_prompt=NEGATIVE, guidance_scale=2.0, height=8, width=8, max_sequence_length=8
        ),
    ),
    "flux": Case(
        build_flux,
        calls=STEPS,
        kwargs=dict(guidance_scale=2.0, height=8, width=8, max_sequence_length=8),
    ),
    # True CFG: two transformer calls per step. Each prompt is encoded to its own length,
    # so the negative prompt has as many words as the prompt: one graph serves both (a
    # negative prompt of another length is a second graph).
    "qwenimage": Case(
        build_qwenimage,
        calls=2 * STEPS,
        kwargs=dict(
            negative_prompt="a dog on a rug",
            true_cfg_scale=2.0,
            height=16,
            width=16,
            max_sequence_length=8,
        ),
    ),
    "wan": Case(
        build_wan,
        calls=2 * STEPS,
        kwargs=dict(
            negative_prompt=NEGATIVE,
            guidance_scale=2.0,
            height=16,
            width=16,
            num_frames=5,
            max_sequence_length=8,
        ),
    ),
    # Guidance off and no spatio-temporal guidance blocks: one transformer call per step.
    # Latents out (video and audio): the VAEs and the vocoder, eager, add ~70 programs
    # to compile for little (the "np" output matched CPU too when checked by hand).
    # One graph: the first step's latents are the packing's permuted view, and later
    # steps' (the scheduler's result) keep that layout, on tpu as on CPU (Note [Result
    # layouts follow CPU]); Dynamo guards on strides, so a contiguous result would
    # capture a second graph.
    "ltx2": Case(
        build_ltx2,
        calls=STEPS,
        graphs=1,
        kwargs=dict(
            height=32,
            width=32,
            num_frames=5,
            frame_rate=25.0,
            max_sequence_length=8,
            guidance_scale=1.0,
            stg_scale=0.0,
            modality_scale=1.0,
            guidance_rescale=0.0,
            audio_guidance_scale=1.0,
            audio_stg_scale=0.0,
            audio_modality_scale=1.0,
            audio_guidance_rescale=0.0,
            spatio_temporal_guidance_blocks=None,
            output_type="latent",
        ),
    ),
}
