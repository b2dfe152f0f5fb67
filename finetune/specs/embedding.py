"""`task: embedding`, sentence embeddings (anchor–positive pairs or scored sentence pairs): what the registry knows of
the kind without importing its implementation (`finetune.kinds.embedding`)."""

from __future__ import annotations

from finetune.specs import Entry, Option

ENTRY = Entry(
    name="embedding", order=100, module="finetune.kinds.embedding",
    summary="sentence embeddings (anchor–positive pairs or scored sentence pairs)",
    columns=("anchor_column", "positive_column", "negative_column", "score_column"),
    own_columns=(("anchor_column", "positive_column", "negative_column", "score_column"),),
    uses="`anchor_column` and `positive_column` (or with `score_column`)",
    auto_model="AutoModel", peft_task_type="FEATURE_EXTRACTION", peft_auto_model="AutoPeftModel",
    pipeline_tag="sentence-similarity",
    # A base model (BertModel, …): after causal_lm, whose GPT-2 "LMHeadModel" also ends so.
    architectures=("Model",), example="A man is eating food.",
    metrics=("cosine_accuracy@1", "cosine_ndcg@10", "spearman_cosine"),
    settings=("embedding_loss", "embedding_scale", "pooling", "normalize"), whole_window=True,
    declares=(Option("anchor_column", str, None, "Embedding: the anchor (query) column (default 'anchor', "
                     "'query' or 'sentence1')."),
              Option("positive_column", str, None, "Embedding: the positive (document) column, or the second "
                     "sentence of a scored pair (default 'positive', 'document' or 'sentence2')."),
              Option("negative_column", str, None, "Embedding: an optional hard-negative column (default "
                     "'negative' if present)."),
              Option("score_column", str, None, "Embedding: the similarity of a scored pair, in [0, 1] "
                     "(default 'score' or 'similarity' beside sentence pairs); scored pairs train with "
                     "CoSENT."),
              Option("embedding_loss", str, "auto", "Embedding: the loss: mnrl (multiple-negatives ranking: "
                     "each anchor's positive against every positive and negative of the window) or cosent "
                     "(scored pairs); auto follows the data's shape.", choices=("auto", "mnrl", "cosent"),
                     group="advanced"),
              Option("embedding_scale", float, 20.0, "Embedding: the scale of the cosine similarities in the "
                     "loss (an inverse temperature; sentence-transformers' default 20).", min=1e-3,
                     max=1000.0, group="advanced"),
              Option("pooling", str, "auto", "Embedding: how token states become one vector: mean, cls or "
                     "last token (auto: a sentence-transformers model's own pooling, else mean).",
                     choices=("auto", "mean", "cls", "last"), group="advanced"),
              Option("normalize", str, "auto", "Embedding: scale the saved model's embeddings to unit length "
                     "(auto: as a sentence-transformers model does, else true; the cosine loss is the same "
                     "either way).", choices=("auto", "true", "false"), group="advanced")),
    refusals={"packing": "an embedding model reads each sentence whole, in-batch negatives beside it",
              "segment_recurrence": "an embedding model reads each sentence whole; turn it off",
              "split_documents": "a pair's sentences are cut at `max_length`, not split; use "
                                 "long_documents=truncate (or auto)"},
    try_view="vector",
    guide="task-kinds.md#sentence-embeddings",
)
