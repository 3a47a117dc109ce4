"""OpenAI chat messages and their content parts (text, image_url, input_audio, and vLLM's
audio_url / video_url), validated strictly (``StrictModel``: an unknown field or a wrongly typed
value is a 400), and their translation to what chat templates expect. The requests that carry
them: ``api.protocol``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swaserve.api.errors import ProtocolError


class StrictModel(BaseModel):
    """The base of every request model: unknown fields and wrongly typed values are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class MediaURL(StrictModel):
    """``{"url": ...}``: a ``data:`` URL (base64), or http(s)/file where the server allows it.
    ``detail`` (images): only "auto" (the model has one resolution policy)."""

    url: str
    detail: str | None = None  # checked with the media (api.media.check_part): only "auto"


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: MediaURL | str


class InputAudio(StrictModel):
    data: str  # base64
    format: str  # wav, mp3, flac, ogg, m4a, ... (the container PyAV reads)


class AudioPart(StrictModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AudioURLPart(StrictModel):  # vLLM's extension
    type: Literal["audio_url"]
    audio_url: MediaURL | str


class VideoPart(StrictModel):  # vLLM's extension
    type: Literal["video_url"]
    video_url: MediaURL | str


ContentPart = Annotated[
    TextPart | ImagePart | AudioPart | AudioURLPart | VideoPart, Field(discriminator="type")
]
MEDIA_PART_TYPES = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}


def part_modality(part: Any) -> str | None:
    """The modality of a content part (None: text)."""
    return MEDIA_PART_TYPES.get(part.type)


def part_url(part: Any) -> str:
    """A media part's URL (``input_audio`` as a data URL of its format, as vLLM does)."""
    if isinstance(part, AudioPart):
        return f"data:audio/{part.input_audio.format};base64,{part.input_audio.data}"
    value = getattr(part, part.type)
    return value if isinstance(value, str) else value.url


class ChatMessage(StrictModel):
    """One chat message: OpenAI's fields, each honored or refused. ``tool_calls`` (assistant) and
    ``tool_call_id`` (tool, required there) and vLLM's ``reasoning_content`` (assistant) go to the
    chat template; ``refusal``, ``annotations``, ``audio`` and ``function_call`` are accepted only
    as null (the openai client sends them back that way when a response message is replayed)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _fields_fit_the_role(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, list) and not self.content:
            raise ValueError("content must be a string or a non-empty list of parts")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages need a tool_call_id, and only they carry one")
        if self.role != "user" and self.media_parts():
            raise ValueError("only user messages may carry images, audio or video")
        return self

    def media_parts(self) -> list[Any]:
        """The image/audio/video parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if part_modality(p) is not None]

    def template_dict(self, markers: dict[str, str] | None = None) -> dict[str, Any]:
        """The message as chat templates expect it: parts joined by newlines into one string, a
        media part as its modality's marker text (``markers``, e.g. ``<|vision_start|><|image_pad|>
        <|vision_end|>``, expanded after tokenization); ``developer`` (OpenAI's newer name for the
        system role) as ``system``, which templates know."""
        out = self.model_dump(exclude_none=True)
        if out["role"] == "developer":
            out["role"] = "system"
        if isinstance(self.content, list):
            pieces = []
            for p in self.content:
                m = part_modality(p)
                if isinstance(p, TextPart):
                    pieces.append(p.text)
                elif m is None or markers is None or m not in markers:
                    raise ProtocolError(f"this model does not take {m} input", param="messages")
                else:
                    pieces.append(markers[m])
            out["content"] = "\n".join(pieces)
        elif self.content is None:
            out["content"] = ""
        return out
