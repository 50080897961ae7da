"""Data: documents from the embedded corpus, local files or the Hugging Face hub, tokenized
with BOS/EOS (or conversations rendered with a chat template, the prompt's labels
``IGNORE_INDEX``), packed into ``seq_len + 1`` windows and sharded over data-parallel ranks
by a stateful dataloader whose state reshards when the data-parallel degree changes; or a
weighted mixture of several such sources (``MixtureDataLoader``).

    loader = build_dataloader(DataConfig(seq_len=256), load_tokenizer(), dp_rank=0, dp_degree=1)
    inputs, labels = next(iter(loader))      # 8 x 256 each; labels are inputs shifted by one
"""

from titan_train.data.chat import ChatEncoder, build_chat_encoder
from titan_train.data.chat_template import BUILTIN_TEMPLATES, ChatTemplate, load_chat_template
from titan_train.data.config import IGNORE_INDEX, DataConfig, DataError, DatasetEntry, DataSource
from titan_train.data.dataloader import TextDataLoader, build_dataloader
from titan_train.data.embedded import (
    CHAT_SAMPLE_DATASET,
    EMBEDDED_DATASET,
    chat_sample_path,
    embedded_documents,
)
from titan_train.data.mixture import MixtureDataLoader, build_mixture_dataloader
from titan_train.data.sources import DocumentSource, open_documents

__all__ = [
    "BUILTIN_TEMPLATES",
    "CHAT_SAMPLE_DATASET",
    "EMBEDDED_DATASET",
    "IGNORE_INDEX",
    "ChatEncoder",
    "ChatTemplate",
    "DataConfig",
    "DataError",
    "DataSource",
    "DatasetEntry",
    "DocumentSource",
    "MixtureDataLoader",
    "TextDataLoader",
    "build_chat_encoder",
    "build_dataloader",
    "build_mixture_dataloader",
    "chat_sample_path",
    "embedded_documents",
    "load_chat_template",
    "open_documents",
]
