"""Built-in English corpus that synthetic benchmark prompts are cut from.

The text is public-domain prose (opening passages of Jane Austen, Herman Melville, Mark Twain,
Charles Dickens and Lewis Carroll, all published before 1900) so prompts read like natural text
and tokenize like it, without shipping or downloading any data set.
"""

CORPUS_TEXT = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must \
be in want of a wife. However little known the feelings or views of such a man may be on his \
first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding \
families, that he is considered the rightful property of some one or other of their daughters. \
"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let \
at last?" Mr. Bennet replied that he had not. "But it is," returned she; "for Mrs. Long has just \
been here, and she told me all about it." Mr. Bennet made no answer. "Do you not want to know who \
has taken it?" cried his wife impatiently. "You want to tell me, and I have no objection to \
hearing it." This was invitation enough.

Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my \
purse, and nothing particular to interest me on shore, I thought I would sail about a little and \
see the watery part of the world. It is a way I have of driving off the spleen and regulating the \
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly \
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and \
bringing up the rear of every funeral I meet; then, I account it high time to get to sea as soon \
as I can. This is my substitute for pistol and ball. There is nothing surprising in this. If they \
but knew it, almost all men in their degree, some time or other, cherish very nearly the same \
feelings towards the ocean with me.

You don't know about me without you have read a book by the name of The Adventures of Tom Sawyer; \
but that ain't no matter. That book was made by Mr. Mark Twain, and he told the truth, mainly. \
There was things which he stretched, but mainly he told the truth. That is nothing. I never seen \
anybody but lied one time or another. Now the way that the book winds up is this: Tom and me found \
the money that the robbers hid in the cave, and it made us rich. We got six thousand dollars \
apiece, all gold. It was an awful sight of money when it was piled up. Well, Judge Thatcher he \
took it and put it out at interest, and it fetched us a dollar a day apiece all the year round, \
more than a body could tell what to do with.

It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of \
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of \
Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair, we \
had everything before us, we had nothing before us, we were all going direct to Heaven, we were \
all going direct the other way. There were a king with a large jaw and a queen with a plain face, \
on the throne of England; there were a king with a large jaw and a queen with a fair face, on the \
throne of France. In both countries it was clearer than crystal to the lords of the State \
preserves of loaves and fishes, that things in general were settled for ever.

Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing \
to do: once or twice she had peeped into the book her sister was reading, but it had no pictures \
or conversations in it, "and what is the use of a book," thought Alice, "without pictures or \
conversations?" So she was considering in her own mind, as well as she could, for the hot day made \
her feel very sleepy and stupid, whether the pleasure of making a daisy-chain would be worth the \
trouble of getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran \
close by her. There was nothing so very remarkable in that; nor did Alice think it so very much \
out of the way to hear the Rabbit say to itself, "Oh dear! Oh dear! I shall be late!"

Marley was dead, to begin with. There is no doubt whatever about that. The register of his burial \
was signed by the clergyman, the clerk, the undertaker, and the chief mourner. Scrooge signed it, \
and Scrooge's name was good upon 'Change for anything he chose to put his hand to. Old Marley was \
as dead as a door-nail. Scrooge knew he was dead? Of course he did. How could it be otherwise? \
Scrooge and he were partners for I don't know how many years. Oh! But he was a tight-fisted hand \
at the grindstone, Scrooge! a squeezing, wrenching, grasping, scraping, clutching, covetous, old \
sinner! Hard and sharp as flint, from which no steel had ever struck out generous fire; secret, \
and self-contained, and solitary as an oyster.
"""
