"""The Try it tab: the finished run's model on a text (an image classifier's: on an uploaded image), shown by the view
its kind's registry entry names (label probabilities, highlighted entities, a value, a score, generated text) or, for
a model trained to chat, a chat."""
