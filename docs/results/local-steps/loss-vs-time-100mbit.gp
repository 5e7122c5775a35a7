set terminal pngcairo size 900,560 noenhanced
set output 'docs/results/local-steps/loss-vs-time-100mbit.png'
set title 'Validation loss against wall time at 100mbit (gpt-micro, 2 nodes x 2 ranks, 500 steps)'
set xlabel 'seconds (steps x mean step time at 100mbit)'; set ylabel 'validation loss'
set logscale x; set grid; set key top right
set arrow from graph 0, first 5.343521535396576 to graph 1, first 5.343521535396576 nohead dashtype 2
plot 'docs/results/local-steps/curve-100mbit-adamw-hsdp.dat' using 1:2 with linespoints title 'adamw-hsdp', 'docs/results/local-steps/curve-100mbit-flexdemo.dat' using 1:2 with linespoints title 'flexdemo', 'docs/results/local-steps/curve-100mbit-flexdemo-2bit.dat' using 1:2 with linespoints title 'flexdemo-2bit', 'docs/results/local-steps/curve-100mbit-diloco-h10.dat' using 1:2 with linespoints title 'diloco-h10', 'docs/results/local-steps/curve-100mbit-diloco-h10-avg.dat' using 1:2 with linespoints title 'diloco-h10-avg', 'docs/results/local-steps/curve-100mbit-diloco-demo-h10.dat' using 1:2 with linespoints title 'diloco-demo-h10', 'docs/results/local-steps/curve-100mbit-diloco-demo-h10-avg.dat' using 1:2 with linespoints title 'diloco-demo-h10-avg', 'docs/results/local-steps/curve-100mbit-diloco-demo-h25-avg.dat' using 1:2 with linespoints title 'diloco-demo-h25-avg'
