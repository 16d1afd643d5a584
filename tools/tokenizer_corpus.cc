// The text that generated tokenizers are learned from: short passages of plain English on many
// subjects, with numbers, punctuation, contractions and dialogue, so that the merges cover
// common words, suffixes and spacing.
#include "tools/byte_level_bpe.h"

namespace tandem {

std::string_view TokenizerCorpus() {
  static constexpr std::string_view kCorpus =
      R"corpus(The morning was cold and clear. By seven o'clock the frost had melted from the windows, and the
kettle was singing on the stove. Anna poured two cups of tea, opened the back door, and called the
dog, who was chasing something invisible at the end of the garden.

"Are you coming with us?" she asked. "We're leaving in ten minutes, and I don't want to be late."
"I'll be there," said Tom. "I've only got to find my shoes. They were here a moment ago."
"They're always here a moment ago," she said, and laughed.

A computer is a machine that follows instructions. The instructions are written as a program, and
the program is stored in memory together with the data it works on. When the machine runs, it
reads one instruction at a time, decodes it, and carries it out: it may add two numbers, compare
them, move a value from one place to another, or jump to a different part of the program. Modern
processors run billions of instructions every second, and they overlap the work on many
instructions at once, so that the whole is much faster than the parts would suggest.

To bake a simple loaf of bread, mix 500 grams of flour with 10 grams of salt and 7 grams of dried
yeast. Add 350 millilitres of warm water and stir until the dough comes together. Knead it for ten
minutes on a floured table, then leave it in a covered bowl for about an hour, until it has doubled
in size. Shape the loaf, let it rise again for 45 minutes, and bake it at 220 degrees for 30 to 35
minutes. The bread is done when it sounds hollow if you tap the bottom.

The river starts as a small stream high in the mountains, where the snow melts in spring. It runs
quickly over stones and through narrow valleys, joined by other streams along the way, until it
reaches the plain. There it slows down, widens, and winds through fields and towns before it
finally meets the sea. People have lived along its banks for thousands of years, fishing in its
waters, farming the rich soil it leaves behind, and using it to carry goods from one town to the
next.

Dear Sam,
Thank you for your letter, which arrived on Tuesday. It was wonderful to hear that the new job is
going well and that you have found a flat near the park. We are all fine here. The children are
back at school, the garden is full of apples, and the weather has been kind to us this autumn.
Please write again soon, and let us know when you will be able to visit.
With love, Margaret

In 1969, two astronauts walked on the surface of the Moon while a third waited for them in orbit.
The journey took about three days in each direction. The lunar module landed in a flat, dusty plain
called the Sea of Tranquility, and the first steps were watched on television by hundreds of
millions of people around the world. The crew returned safely to Earth on 24 July, splashing down
in the Pacific Ocean.

Learning a language takes time and patience. At first, every sentence is a puzzle: you have to
think about each word, its ending, and its place in the sentence. Later, the words begin to come by
themselves, and you start to think in the new language instead of translating. Reading, listening
and speaking every day helps far more than studying for many hours once a week.

The market opens at six in the morning. Farmers arrive with their vans full of vegetables, cheese,
eggs and flowers, and by eight o'clock the square is crowded with shoppers. Prices are written on
small boards: apples 2.50 a kilo, potatoes 1.20, a dozen eggs 3.80. Some people come every week and
know the sellers by name; others stop only to look, to taste, and to enjoy the noise and colour of
the stalls.

Why is the sky blue? Sunlight contains all the colours of the rainbow. When it passes through the
air, the short blue waves are scattered much more strongly than the long red ones, so blue light
reaches our eyes from every part of the sky. At sunset, the light travels through much more air,
most of the blue is scattered away, and the sky turns orange and red.

It's easy to forget how much of our daily life depends on things we never see: the water pipes
under the street, the cables that carry electricity and data, the satellites that tell our phones
where we are. When they work, nobody notices them. When they fail, everything stops, and we
remember how complicated the world really is.

Rules of the game: each player starts with seven cards. On your turn, you may play one card that
matches the colour or the number of the card on the table, or you may draw a new card from the
pile. The first player who has no cards left wins the round. If two players have the same score at
the end of the game, they play one more round to decide the winner.

The old library stood at the corner of the main street, a grey stone building with tall windows
and a heavy wooden door. Inside it was quiet and warm, and it smelled of paper and polish. Children
sat on the floor reading picture books, students worked at the long tables, and an old man slept
in the armchair by the fire, a newspaper open on his knees.

Questions and answers. What time does the train leave? At 9:15 from platform 4. How long does the
journey take? About two hours and twenty minutes. Is there a restaurant on the train? Yes, there is
a small cafe in the middle of the train, and it's open until 8 p.m. Can I bring my bicycle? Yes, but
you must book a place for it in advance.

Good software is written for people as much as for machines. Names should say what things are,
functions should do one thing, and errors should explain what went wrong and where. Tests show that
the code does what it claims to do, and they keep it working when it changes. The best programs are
often the simplest ones: small, clear, and easy to read.

She'd never seen the ocean before. When the bus came over the last hill and the water appeared,
bright and endless under the afternoon sun, she pressed her face against the window and didn't say
a word for a long time. Then she turned to her father and whispered, "It's bigger than I thought."
)corpus";
  return kCorpus;
}

}  // namespace tandem
