# The gap to AdamW-HSDP against node count (docs/results/many-nodes.md, issue 55): 100 x (final
# validation loss / AdamW-HSDP's - 1) at step 1,000, from ../data/nodes-gap-1000.csv:
#   cd docs/results/plots && gnuplot nodes-gap-gpt-micro-1000.gnuplot
$gap << EOD
# nodes, gap to AdamW-HSDP (%): all-gather default; owners, defaults before 2026-12-07 (fp32 statistics, senders); owners, defaults since (log8, owner)
2 -0.4250 NaN NaN
4 -0.3652 0.3006 0.1482
8 0.4661 1.6671 0.8594
EOD
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
     $gap using 1:2 with linespoints pt 7 title "FlexDeMo default, all-gather (8 payloads a node at 8 nodes)", \
     $gap using 1:3 with linespoints pt 7 title "owners' exchange, defaults before 2026-12-07 (2.72 payloads)", \
     $gap using 1:4 with linespoints pt 7 title "owners' exchange, defaults now: owner feedback, log8 (1.96 payloads)"
