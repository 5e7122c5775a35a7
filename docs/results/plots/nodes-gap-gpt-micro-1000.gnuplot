# The gap to AdamW-HSDP against node count (docs/results/many-nodes.md, issue 55), from the final
# validation rows of ../data/nodes-gap-1000.csv (nodes-gap-gpt-micro-1000.dat):
#   cd docs/results/plots && gnuplot nodes-gap-gpt-micro-1000.gnuplot
set terminal pngcairo size 900,550
set output 'nodes-gap-gpt-micro-1000.png'
set title 'final validation loss against AdamW-HSDP (gpt-micro, 1,000 steps)'
set xlabel 'nodes (1 rank a node, the global batch fixed)'
set ylabel 'gap (%)'
set logscale x 2
set xrange [1.6:10]
set xtics (2, 4, 8)
set grid
set key top left Left reverse
set yrange [-0.75:2.5]
plot 0 with lines dt 2 lc 'black' title 'AdamW-HSDP', \
     1 with lines dt 3 lw 2 lc 'red' title 'within 1%', \
     'nodes-gap-gpt-micro-1000.dat' using 1:2 with linespoints pt 7 title "FlexDeMo default, all-gather (8 payloads a node at 8 nodes)", \
     '' using 1:3 with linespoints pt 7 title "owners' exchange, defaults before 2026-12-07 (2.72 payloads)", \
     '' using 1:4 with linespoints pt 7 title "owners' exchange, defaults now: owner feedback, log8 (1.96 payloads)"
