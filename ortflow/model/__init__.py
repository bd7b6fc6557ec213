"""Model builders: plain typed functions returning an nn.Module, referenced from conf/model/*.yaml by
`_target_`. A model maps an input batch of shape (B, ...) to logits of shape (B, ..., C); the engines flatten
the logits and targets and apply cross-entropy, so any classifier or language model fits."""
